"""English documents: diaries, weather, recipes, news, travel notes, explainers, letters, stories, reviews, how-tos.

Written for this project (templates and word lists), so the generated corpus can be shipped. Tuples are word forms:
verbs (past, present participle, base), adjectives (plain, adverb).
"""

from __future__ import annotations

import random

from benchmarks.corpus_gen.fill import Filler, capitalize_first

V = {
    "name": ["Alice", "Ben", "Chloe", "Daniel", "Emma", "Felix", "Grace", "Henry", "Isla", "Jack", "Kate", "Liam",
             "Maya", "Noah", "Olivia", "Peter", "Quinn", "Rosa", "Sam", "Tara", "Umar", "Vera", "Will", "Yuki",
             "Zoe", "Hana", "Kenji", "Priya", "Omar", "Lucia"],
    "surname": ["Smith", "Jones", "Taylor", "Brown", "Wilson", "Evans", "Thomas", "Roberts", "Walker", "Wright",
                "Clarke", "Hughes", "Edwards", "Green", "Hall", "Wood", "Harris", "Martin", "Cooper", "King"],
    "relative": ["my sister", "my brother", "my mother", "my father", "a friend", "my neighbour", "my grandmother",
                 "an old classmate", "my cousin", "a colleague", "my aunt", "my uncle"],
    "city": ["Edinburgh", "Dublin", "Lisbon", "Porto", "Seville", "Lyon", "Bruges", "Vienna", "Prague", "Krakow",
             "Copenhagen", "Oslo", "Bergen", "Helsinki", "Tallinn", "Montreal", "Quebec City", "Boston", "Seattle",
             "Vancouver", "Melbourne", "Wellington", "Kyoto", "Osaka", "Sapporo", "Busan", "Hanoi", "Cape Town",
             "Valparaiso", "Bologna"],
    "region": ["the north", "the south", "the east coast", "the west coast", "the mountains", "the central valley",
               "the islands", "the capital", "coastal areas", "inland areas"],
    "weather": ["sunny", "cloudy", "rainy", "windy", "foggy", "partly cloudy", "stormy", "snowy", "mild", "humid"],
    "weekday": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"],
    "monthname": ["January", "February", "March", "April", "May", "June", "July", "August", "September",
                  "October", "November", "December"],
    "day": lambda r: r.randint(1, 28),
    "year": lambda r: r.randint(1990, 2024),
    "temp_hi": lambda r: r.randint(12, 35),
    "temp_lo": lambda r: r.randint(-5, 11),
    "pct": lambda r: r.choice([0, 10, 20, 30, 40, 50, 60, 70, 80, 90]),
    "small": lambda r: r.choice(["two", "three", "four", "five", "six", "seven", "eight"]),
    "num": lambda r: r.randint(10, 99),
    "big": lambda r: r.choice([120, 150, 200, 250, 300, 400, 500, 750, 1000, 1200, 2500, 5000]),
    "minutes": lambda r: r.choice([5, 10, 15, 20, 25, 30, 40, 45]),
    "hour": lambda r: r.randint(6, 11),
    "stars": lambda r: r.randint(1, 5),
    "season": ["spring", "summer", "autumn", "winter"],
    "place": ["the park", "the library", "the museum", "the market", "the beach", "the old harbour", "the zoo",
              "the botanical garden", "a small bookshop", "the river path", "the art gallery", "the train station",
              "a quiet cafe", "the hill behind the town", "the swimming pool", "the cinema"],
    "activity": [("read a novel", "reading a novel", "read a novel"), ("baked bread", "baking bread", "bake bread"),
                 ("went for a run", "running", "go for a run"), ("cleaned the kitchen", "cleaning the kitchen", "clean the kitchen"),
                 ("wrote some letters", "writing letters", "write letters"), ("painted the fence", "painting the fence", "paint the fence"),
                 ("practised the piano", "practising the piano", "practise the piano"), ("watched an old film", "watching old films", "watch an old film"),
                 ("repaired my bicycle", "repairing my bicycle", "repair my bicycle"), ("planted tomatoes", "planting tomatoes", "plant tomatoes"),
                 ("studied Japanese", "studying Japanese", "study Japanese"), ("sorted old photographs", "sorting old photographs", "sort old photographs"),
                 ("went swimming", "swimming", "go swimming"), ("visited the market", "visiting the market", "visit the market")],
    "adj": [("quiet", "quietly"), ("busy", "busily"), ("beautiful", "beautifully"), ("strange", "strangely"),
            ("calm", "calmly"), ("cheerful", "cheerfully"), ("cold", "coldly"), ("warm", "warmly"),
            ("pleasant", "pleasantly"), ("lively", "in a lively way"), ("peaceful", "peacefully")],
    "feeling": ["happy", "tired but content", "relaxed", "a little homesick", "surprised", "grateful", "calm",
                "excited about the week ahead"],
    "food": ["a bowl of soup", "fish and chips", "a vegetable curry", "a mushroom risotto", "pancakes", "a cheese sandwich",
             "roast chicken", "noodles with sesame", "a salad with lentils", "fresh bread and butter", "grilled salmon",
             "a slice of apple pie", "dumplings", "tomato pasta", "rice with miso soup"],
    "dish": ["tomato soup", "banana bread", "vegetable stew", "lemon cake", "fried rice", "pumpkin soup", "flatbread",
             "oat biscuits", "potato salad", "chicken curry", "bean chili", "apple crumble"],
    "ingredient": ["onions", "carrots", "potatoes", "garlic", "tomatoes", "flour", "butter", "eggs", "milk", "sugar",
                   "lentils", "rice", "spinach", "mushrooms", "apples", "lemons", "beans", "ginger", "celery", "oats"],
    "tool": ["a large pot", "a frying pan", "a baking tray", "a mixing bowl", "a sharp knife", "a wooden spoon",
             "a saucepan", "a loaf tin"],
    "org": ["the city council", "a local charity", "the regional transport authority", "researchers at the university",
            "a small software company", "the national weather service", "the town library", "a group of farmers",
            "the harbour authority", "the school board"],
    "project": ["a new cycle lane", "a community garden", "an electric bus service", "a public reading room",
                "a flood barrier", "a free coding class", "a repair cafe", "a solar panel programme",
                "a night market", "a tree planting scheme"],
    "sight": ["the cathedral", "the old town", "the castle on the hill", "the harbour", "the covered market",
              "the botanical garden", "the lighthouse", "the riverside walk", "the city walls", "the opera house"],
    "souvenir": ["local cheese", "hand-made soap", "ceramics", "tea", "postcards", "wool scarves", "honey", "chocolate"],
    "transport": ["train", "bus", "tram", "ferry", "bicycle", "car"],
    "item": ["kettle", "backpack", "desk lamp", "rice cooker", "pair of headphones", "umbrella", "coffee grinder",
             "notebook", "pair of walking boots", "electric toothbrush", "wireless keyboard", "water bottle"],
    "animal": ["fox", "crow", "hare", "tortoise", "owl", "mouse", "bear", "deer", "heron", "cat", "wolf", "frog"],
    "hero": [(f"{a} {w}", f"the {w}") for a, w in [("an", "old fisherman"), ("a", "young shepherd"), ("a", "clever girl"),
             ("a", "tired traveller"), ("a", "poor tailor"), ("a", "kind baker"), ("a", "brave boy"),
             ("an", "old woman")]],
    "treasure": ["a golden key", "a silver bell", "a map drawn on leather", "a bag of seeds that never ran out",
                 "a lantern that never went out", "a small wooden box"],
    "job": ["nurse", "teacher", "engineer", "student", "chef", "designer", "farmer", "librarian", "doctor", "carpenter"],
    "hobby": ["gardening", "chess", "hiking", "photography", "knitting", "cycling", "birdwatching", "painting",
              "baking", "swimming"],
    "task": ["change a bicycle tyre", "make a simple budget", "start a vegetable garden", "learn a new language",
             "write a clear email", "keep a houseplant alive", "prepare for a job interview", "organise a small kitchen"],
}

FACTS = [
    "Water boils at 100 degrees Celsius at sea level and freezes at 0 degrees.",
    "The Earth takes about 365 days to travel once around the Sun.",
    "Light travels at roughly 300,000 kilometres per second.",
    "Plants use sunlight to turn carbon dioxide and water into sugar and oxygen.",
    "Sound travels through air at about 340 metres per second.",
    "The Moon has no light of its own; it reflects the light of the Sun.",
    "Iron is attracted by magnets, but aluminium and copper are not.",
    "A rainbow appears when sunlight is bent and reflected inside raindrops.",
    "The human heart beats around one hundred thousand times a day.",
    "Ice floats because it is less dense than liquid water.",
    "There are eight planets in the Solar System, and Jupiter is the largest.",
    "Most metals conduct electricity and heat well.",
    "Bees carry pollen from flower to flower and help plants make seeds.",
    "Computers store all information as patterns of zeros and ones.",
    "About 78 percent of the air is nitrogen and about 21 percent is oxygen.",
    "Whales are mammals: they breathe air with lungs and feed their young with milk.",
    "Leaves look green because they contain a pigment called chlorophyll.",
    "Sea water is salty because minerals from rocks dissolve into rivers and flow to the sea.",
    "Counting the seconds between lightning and thunder tells you roughly how far away a storm is.",
    "Penguins are birds, but they use their wings to swim rather than to fly.",
    "Mount Fuji, the highest mountain in Japan, is 3,776 metres tall.",
    "Tokyo is the capital of Japan, and Lake Biwa is the largest lake in the country.",
]

DIARY = [
    "On {weekday} I went to {place} with {relative}.",
    "The weather was {weather}, so we took our time.",
    "In the morning I {activity.0}, which I had not done for weeks.",
    "For lunch we had {food}, and it was better than I expected.",
    "{place} was {adj.0} today, and I stayed longer than I planned.",
    "In the afternoon {relative} and I {activity.0}.",
    "I woke up at {hour} and {activity.0} before breakfast.",
    "Next week I am going to {city}, and I am already looking forward to it.",
    "{relative} called in the evening and we talked for {minutes} minutes.",
    "Before going to bed I {activity.0} for a while.",
    "Tomorrow is supposed to be {weather}, so I will take an umbrella just in case.",
    "On the way home I saw a {animal} near the road.",
    "All in all, I felt {feeling}.",
]

WEATHER = [
    "Tomorrow will be {weather} in {region}, with a high of {temp_hi} degrees.",
    "Overnight temperatures will fall to around {temp_lo} degrees.",
    "The chance of rain is {pct} percent in the morning and {pct} percent in the afternoon.",
    "Winds will be light at first but will pick up later in the day.",
    "In {city}, expect a {weather} start followed by a {weather} afternoon.",
    "Drivers should take care, as fog may form in low-lying areas.",
    "It will feel like {season} for most of the week.",
    "Sea conditions will be rough, so ferry services may be delayed.",
    "If you are heading out, a light jacket is a good idea.",
    "The weekend looks {weather}, with temperatures close to the seasonal average.",
]

RECIPE = [
    "Chop the {ingredient} and put them in {tool}.",
    "Heat a little oil in {tool} over a medium flame.",
    "Add the {ingredient} and stir for {minutes} minutes.",
    "Season with salt and pepper, then add the {ingredient}.",
    "Let it simmer gently for {minutes} minutes, stirring from time to time.",
    "Mix the {ingredient} and the {ingredient} in {tool} until smooth.",
    "Bake for {minutes} minutes, or until golden on top.",
    "Taste, adjust the seasoning, and serve warm.",
    "If you have no {ingredient}, you can use {ingredient} instead.",
    "It keeps for {small} days in the fridge.",
]

NEWS = [
    "The project will cost around {big} thousand dollars and is expected to open in {monthname}.",
    "More than {big} people attended the opening on {weekday}.",
    "\"We want this to be useful for everyone in the city,\" said {name} {surname}, who led the work.",
    "A survey found that {pct} percent of residents supported the plan.",
    "Some residents raised concerns about the cost.",
    "Similar schemes have already started in {city} and {city}.",
    "The work took {small} years to complete.",
    "Officials said they would review the results next {season}.",
    "Local businesses say they have already seen more visitors.",
    "{name} {surname}, a {job} who lives nearby, said the change was long overdue.",
]

TRAVEL = [
    "From the station it is a {minutes}-minute walk to {sight}.",
    "{sight} is best visited early in the morning, before the crowds arrive.",
    "The streets around {sight} are full of small shops selling {souvenir}.",
    "In {season} the city hosts a festival that fills every square with music.",
    "You can reach the city from the capital in about {small} hours by {transport}.",
    "The local speciality is {food}, served in almost every cafe.",
    "Good walking shoes are essential, as many streets are steep and cobbled.",
    "For souvenirs, try the {souvenir} sold at the covered market.",
    "In the evening we ate at a family restaurant near {sight}.",
    "Our guide told us the history of {sight}, which goes back several hundred years.",
]

STORY = [
    "One day {hero.1} found a {animal} caught in a net.",
    "{hero.1} felt sorry for the {animal} and set it free.",
    "\"I will not forget your kindness,\" said the {animal}, and it ran into the forest.",
    "Many months later, on a cold winter night, there was a knock at the door.",
    "When {hero.1} opened the door, there was {treasure} on the step.",
    "The villagers were amazed and praised the kindness of {hero.1}.",
    "{hero.1} shared {treasure} with everyone in the village.",
    "From that year on, the harvest was good, and nobody in the village went hungry.",
]

REVIEW = [
    "I have been using this {item} for {small} months now.",
    "The design is simple and it is easy to use.",
    "It cost about {big} yen, which I think is fair.",
    "It is a little heavier than I expected, but I got used to it quickly.",
    "Compared with my old {item}, it is much quieter.",
    "The instructions were clear and I had it working in minutes.",
    "I would give it {stars} out of 5 stars.",
    "I would buy it again, and I have already recommended it to {relative}.",
]

HOWTO = [
    "First, decide what you want to achieve and write it down.",
    "Gather everything you need before you start.",
    "Break the job into small steps and do one step at a time.",
    "Set aside {minutes} minutes a day rather than one long session a week.",
    "Ask {relative} to check your progress now and then.",
    "Do not worry about mistakes; they are part of learning.",
    "Keep notes, so that next time you can see what worked.",
    "After {small} weeks, look back and adjust your plan.",
]

PROFILE = [
    "{name} {surname} is a {job} who lives in {city}.",
    "Since childhood, {name} has loved {hobby}.",
    "Every morning {name} gets up at {hour} and takes the {transport} to work.",
    "At weekends {name} often goes to {place} with {relative}.",
    "\"I want more people to enjoy {hobby},\" {name} says.",
    "This year {name} hopes to {activity.2} more often.",
]


def _sentences(f: Filler, pool: list[str], lo: int, hi: int) -> str:
    return " ".join(capitalize_first(s) for s in f.pick(pool, f.rng.randint(lo, hi)))


def _diary(f):
    f.bind("place", "relative", "weather")
    return f("{weekday}, {monthname} {day}\n") + _sentences(f, DIARY, 4, 8)


def _weather(f):
    f.bind("region", "season")
    return "Weather outlook\n" + _sentences(f, WEATHER, 4, 7)


def _recipe(f):
    f.bind("dish")
    steps = f.pick(RECIPE, f.rng.randint(5, 8), ordered=True)
    head = f(f.rng.choice(["How to make {dish}", "A simple {dish} for {season} evenings", "{dish}: a family recipe"]))
    return capitalize_first(head) + "\n" + "\n".join(f"{i}. {s}" for i, s in enumerate(steps, 1))


def _news(f):
    f.bind("org", "project", "city")
    lead = f("{org} announced {project} in {city} on {weekday}.")
    return capitalize_first(lead) + " " + _sentences(f, NEWS, 3, 6)


def _travel(f):
    f.bind("city", "sight", "season", "souvenir")
    return f("A few days in {city}\n") + _sentences(f, TRAVEL, 4, 8)


def _explain(f):
    facts = f.rng.sample(FACTS, f.rng.randint(3, 6))
    intro = f.rng.choice(["Here are a few facts about the world around us.", "Science in everyday life:",
                          "Some things we learnt at school and often forget:"])
    return intro + "\n" + "\n".join(facts)


def _letter(f):
    f.bind("name", "city")
    body = f.pick(["Thank you for your letter, which arrived on {weekday}.", "We are all well here.",
                   "{relative} has started working as a {job} in {city}.", "The garden is {adj.0} this {season}.",
                   "I have taken up {hobby} and I enjoy it very much.", "Please come and visit us when you are in {city}."],
                  f.rng.randint(3, 5))
    return f("Dear {name},\n\n") + " ".join(capitalize_first(s) for s in body) + f("\n\nWith best wishes,\n{name}")


def _story(f):
    f.bind("hero", "animal", "treasure")
    opening = f("Once upon a time, in a village by the sea, there lived {hero.0}.")
    return opening + " " + " ".join(capitalize_first(f(s)) for s in STORY[:f.rng.randint(4, len(STORY))])


def _review(f):
    f.bind("item")
    return _sentences(f, REVIEW, 4, 7)


def _howto(f):
    f.bind("task")
    steps = f.pick(HOWTO, f.rng.randint(4, 7))
    return capitalize_first(f("how to {task}")) + "\n" + "\n".join(f"- {s}" for s in steps)


def _profile(f):
    f.bind("name", "surname", "job", "city", "hobby")
    return " ".join(f(s) for s in PROFILE[:2]) + " " + _sentences(f, PROFILE[2:], 2, 4)


def _arithmetic(f):
    r = f.rng
    lines = ["Practice sums:"]
    for _ in range(r.randint(4, 8)):
        a, b = r.randint(1, 99), r.randint(1, 99)
        op = r.choice(["+", "-", "*"])
        lines.append(f"{a} {op} {b} = {a + b if op == '+' else a - b if op == '-' else a * b}")
    return "\n".join(lines)


KINDS = [(_diary, 3), (_weather, 2), (_recipe, 2), (_news, 3), (_travel, 3), (_explain, 2), (_letter, 1),
         (_story, 2), (_review, 2), (_howto, 2), (_profile, 2), (_arithmetic, 1)]


def documents(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    makers = [m for m, w in KINDS for _ in range(w)]
    return ["\n\n".join(rng.choice(makers)(Filler(V, rng)) for _ in range(rng.choice([1, 1, 1, 2])))
            for _ in range(n)]
