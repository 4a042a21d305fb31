"""SentencePiece tokenizers in LLM-jp v3's layout: train one, load any ``.model``, save it as a Hugging Face tokenizer.

Layout (LLM-jp v3): ``<unk>``=0, ``<s>``=1, ``</s>``=2, then the control pieces ``<MASK|LLM-jp>``, ``<PAD|LLM-jp>``,
``<CLS|LLM-jp>``, ``<SEP|LLM-jp>``, ``<EOD|LLM-jp>`` = 3..7, then the 256 byte pieces (byte fallback), then the
learnt pieces. Normalisation is LLM-jp's: identity (no NFKC), whitespace kept as is (runs of spaces matter in
code), a dummy ``▁`` prefix, digits split.

End of document: a document is stored as ``[bos] + pieces + [eos]``. Megatron-LM's ``Llama2Tokenizer`` returns
the model's ``eos_id`` as ``eod`` and LLM-jp's own tokenizer config says ``"eod_token": "</s>"``, so ``eod_id`` here
is the eos id (2), not the ``<EOD|LLM-jp>`` piece (7, see ``eod_piece_id``), which no LLM-jp corpus contains.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from itertools import chain, repeat
from pathlib import Path
from typing import TYPE_CHECKING

from llmjp_ds.data.inputs import iter_documents, resolve_inputs
from llmjp_ds.errors import fail
from llmjp_ds.io_utils import ensure_writable_dir, write_bytes_atomic

if TYPE_CHECKING:
    import numpy as np

LLMJP_CONTROL_PIECES = ["<MASK|LLM-jp>", "<PAD|LLM-jp>", "<CLS|LLM-jp>", "<SEP|LLM-jp>", "<EOD|LLM-jp>"]
MODEL_FILE = "tokenizer.model"
_PIECE_NORMAL, _PIECE_UNKNOWN, _PIECE_CONTROL, _PIECE_USER, _PIECE_UNUSED, _PIECE_BYTE = 1, 2, 3, 4, 5, 6


def resolve_model_path(path: str | Path) -> Path:
    """A ``.model`` file, or a directory holding ``tokenizer.model`` -> the ``.model`` path."""
    path = Path(path)
    if path.is_dir():
        candidate = path / MODEL_FILE
        if not candidate.is_file():
            models = sorted(path.glob("*.model"))
            if len(models) != 1:
                fail(f"tokenizer directory {path} has no {MODEL_FILE}: pass the SentencePiece .model file itself, "
                     f"or a directory written by `llmjp-ds train-tokenizer`")
            candidate = models[0]
        return candidate
    if not path.exists():
        fail(f"tokenizer {path} not found: pass a SentencePiece .model file or a directory holding {MODEL_FILE}")
    return path


class Tokenizer:
    """A SentencePiece model with the ids the data pipeline needs. ``encode`` returns pieces only (no BOS/EOS)."""

    def __init__(self, model_path: str | Path):
        import sentencepiece as spm

        self.model_path = resolve_model_path(model_path)
        self.sp = spm.SentencePieceProcessor()
        try:
            self.sp.Load(str(self.model_path))
        except (OSError, RuntimeError) as exc:
            fail(f"{self.model_path} is not a SentencePiece model ({str(exc).splitlines()[0][:120]}): pass a .model "
                 f"file written by SentencePiece or `llmjp-ds train-tokenizer`")
        self.vocab_size = self.sp.GetPieceSize()
        self.unk_id = self.sp.unk_id()
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        if self.bos_id < 0 or self.eos_id < 0:
            fail(f"tokenizer {self.model_path} has no <s>/</s> pieces (bos_id={self.bos_id}, eos_id={self.eos_id}): "
                 f"documents need both; train it with `llmjp-ds train-tokenizer`")
        # what Megatron-LM's Llama2Tokenizer appends with --append-eod (its `eod` property returns eos_id)
        self.eod_id = self.eos_id
        self.eod_piece_id = self._find_piece("<EOD|LLM-jp>", "<EOD>")
        pad = self.sp.pad_id()
        self.pad_id = pad if pad >= 0 else self._find_piece("<PAD|LLM-jp>", "<PAD>", "<pad>")

    def _find_piece(self, *names: str) -> int | None:
        for name in names:
            i = self.sp.PieceToId(name)
            if i != self.unk_id and self.sp.IdToPiece(i) == name:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Encode many texts; one thread by default (preprocess parallelises with processes instead)."""
        return self.sp.Encode(texts, num_threads=num_threads) if texts else []

    def encode_documents(self, texts: list[str], num_threads: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """Frame texts as corpus documents, each ``[bos] + pieces + [eod]`` (what Megatron-LM's
        ``preprocess_data.py --append-eod`` stores; an empty text gives ``[bos, eod]``).

        Returns ``(tokens, lengths)``: the framed documents back to back (int32) and their lengths (int64).
        The one place that frames documents: ``preprocess`` writes these arrays as they are.
        """
        import numpy as np

        pieces = self.encode_batch(texts, num_threads)
        lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces)) + 2
        head, tail = (self.bos_id,), (self.eod_id,)
        framed = chain.from_iterable(chain.from_iterable(zip(repeat(head), pieces, repeat(tail))))
        return np.fromiter(framed, dtype=np.int32, count=int(lengths.sum())), lengths

    def decode(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])

    def __reduce__(self):  # worker processes reload from the file instead of pickling the C++ object
        return (Tokenizer, (str(self.model_path),))

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.model_path)!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a SentencePiece ``.model`` (or a directory holding ``tokenizer.model``)."""
    return Tokenizer(path)


# -- training -----------------------------------------------------------------------------------------------
def _training_chunks(inputs, text_key: str, max_chars: int = 2000):
    """Yield pieces of documents for the SentencePiece trainer: whole lines (newline kept, so that ``\\n`` is
    learnt as a piece), packed up to ``max_chars``. Bad lines are skipped; preprocess is where they are reported."""
    for _, _, text in iter_documents(inputs, text_key, skip_bad=True):
        buf = ""
        for line in text.splitlines(keepends=True):
            if len(buf) + len(line) > max_chars and buf:
                yield buf
                buf = ""
            while len(line) > max_chars:
                yield line[:max_chars]
                line = line[max_chars:]
            buf += line
        if buf.strip():
            yield buf


def train_tokenizer(inputs: list[str | Path], output_dir: str | Path, vocab_size: int = 8000, text_key: str = "text",
                    max_sentences: int | None = None, force: bool = False, seed_sentencepiece_size: int = 200000,
                    num_threads: int | None = None, quiet: bool = True) -> Path:
    """Train a unigram model with byte fallback in LLM-jp v3's layout; write ``tokenizer.model`` and the HF files.

    ``max_sentences`` caps how many text chunks (lines packed to ~2,000 characters) the trainer samples.
    Returns ``output_dir``, which ``AutoTokenizer.from_pretrained`` and ``load_tokenizer`` both accept.
    """
    inputs = [s.path for s in resolve_inputs(inputs)]
    output_dir = Path(output_dir)
    if (output_dir / MODEL_FILE).exists() and not force:
        fail(f"{output_dir / MODEL_FILE} already exists: choose another --output-dir, or pass --force to replace it")
    min_vocab = 8 + 256 + 1
    if vocab_size < min_vocab:
        fail(f"--vocab-size {vocab_size} is too small: the special and byte pieces alone take {min_vocab - 1}")
    created = not output_dir.exists()
    ensure_writable_dir(output_dir)
    try:
        model = _train_model(inputs, text_key, vocab_size, max_sentences, seed_sentencepiece_size, num_threads, quiet)
    except BaseException:
        if created and output_dir.is_dir() and not any(output_dir.iterdir()):
            output_dir.rmdir()  # a failed run leaves no empty directory of its own behind
        raise
    write_bytes_atomic(output_dir / MODEL_FILE, quantize_scores(model))
    save_hf_tokenizer(output_dir / MODEL_FILE, output_dir)
    return output_dir


SCORE_QUANTUM = 1 / 32


def quantize_scores(model_bytes: bytes) -> bytes:
    """Round piece scores to multiples of 1/32 so that path scores add up exactly in float32 and float64.

    SentencePiece sums Viterbi path scores in float32, ``tokenizers`` in float64. Where two segmentations tie
    exactly (``▁`` + ``▁▁▁▁`` against ``▁▁▁▁`` + ``▁`` in an indented line), rounding noise picks the winner, and
    the two libraries then disagree. With scores on a 1/32 grid every sum below 2**18 in magnitude (documents of
    up to ~20,000 tokens) is exact in both, ties stay ties, and both break them the same way (first found). The
    change in scores (< 0.016 nats) does not measurably change the segmentation otherwise.
    """
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    for piece in proto.pieces:
        if piece.type == _PIECE_NORMAL:
            piece.score = round(piece.score / SCORE_QUANTUM) * SCORE_QUANTUM
    return proto.SerializeToString()


# -- Hugging Face -------------------------------------------------------------------------------------------
def _load_proto(sp_model: str | Path):
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(Path(sp_model).read_bytes())
    except Exception as exc:  # protobuf raises DecodeError, which is not exported under a stable name
        fail(f"{sp_model} is not a SentencePiece model ({type(exc).__name__}): pass a .model file")
    if not proto.pieces:
        fail(f"{sp_model} is not a SentencePiece model (no pieces): pass a .model file")
    return proto


def build_hf_backend(sp_model: str | Path):
    """A ``tokenizers.Tokenizer`` that segments exactly as SentencePiece does, plus the special-token names.

    SentencePiece's unigram encoder is: normalise (charsmap, whitespace, dummy ``▁`` prefix, spaces -> ``▁``),
    then a Viterbi lattice over the whole string, with control/byte pieces never matched from text and an
    unknown character scored ``min(normal scores) - 10`` and spelled as byte pieces. ``tokenizers``' Unigram does
    the same lattice; two things need care: it takes the unknown score from the minimum over *all* pieces, so
    control/byte/unused pieces get the minimum normal score here, and control pieces are registered as special
    tokens so that they are never part of the lattice.
    """
    from tokenizers import AddedToken, Regex
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, normalizers, processors
    from tokenizers.models import Unigram

    proto = _load_proto(sp_model)
    spec, norm = proto.trainer_spec, proto.normalizer_spec
    if spec.model_type != 1:
        fail(f"{sp_model} is a SentencePiece {['', 'unigram', 'bpe', 'word', 'char'][spec.model_type]} model; only "
             f"unigram models (LLM-jp's) can be saved as a Hugging Face tokenizer here")
    normal_scores = [p.score for p in proto.pieces if p.type == _PIECE_NORMAL]
    floor = min(normal_scores) if normal_scores else 0.0
    vocab = [(p.piece, p.score if p.type == _PIECE_NORMAL else floor) for p in proto.pieces]
    unk_id = next((i for i, p in enumerate(proto.pieces) if p.type == _PIECE_UNKNOWN), 0)
    backend = HFTokenizer(Unigram(vocab, unk_id=unk_id, byte_fallback=spec.byte_fallback))

    steps = []
    if norm.precompiled_charsmap:
        steps.append(normalizers.Precompiled(norm.precompiled_charsmap))
    if norm.remove_extra_whitespaces:
        steps += [normalizers.Strip(left=True, right=True), normalizers.Replace(Regex(" {2,}"), " ")]
    if norm.add_dummy_prefix:
        steps.append(normalizers.Prepend("▁"))
    if norm.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "▁"))
    if steps:
        backend.normalizer = normalizers.Sequence(steps)

    dec = [decoders.Replace("▁", " ")] if norm.escape_whitespaces else []
    dec += [decoders.ByteFallback(), decoders.Fuse()]
    if norm.add_dummy_prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(dec)

    specials = [AddedToken(p.piece, special=True, normalized=False)
                for p in proto.pieces if p.type in (_PIECE_CONTROL, _PIECE_UNKNOWN)]
    users = [AddedToken(p.piece, special=False, normalized=False) for p in proto.pieces if p.type == _PIECE_USER]
    backend.add_special_tokens(specials)
    if users:
        backend.add_tokens(users)

    names = {"unk_token": proto.pieces[unk_id].piece}
    if spec.bos_id >= 0:
        names["bos_token"] = proto.pieces[spec.bos_id].piece
        bos = names["bos_token"]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, spec.bos_id)])
    if spec.eos_id >= 0:
        names["eos_token"] = proto.pieces[spec.eos_id].piece
    piece_ids = {p.piece: i for i, p in enumerate(proto.pieces)}
    for key, candidates in (("pad_token", ["<PAD|LLM-jp>", "<PAD>", "<pad>"]), ("cls_token", ["<CLS|LLM-jp>", "<CLS>"]),
                            ("sep_token", ["<SEP|LLM-jp>", "<SEP>"]), ("mask_token", ["<MASK|LLM-jp>", "<MASK>"])):
        if key == "pad_token" and spec.pad_id >= 0:
            names[key] = proto.pieces[spec.pad_id].piece
            continue
        found = next((c for c in candidates if c in piece_ids), None)
        if found:
            names[key] = found
    return backend, names


def _train_model(inputs, text_key: str, vocab_size: int, max_sentences, seed_sentencepiece_size, num_threads,
                 quiet: bool) -> bytes:
    """SentencePiece's unigram model (the serialised bytes) trained on the texts of ``inputs``."""
    import sentencepiece as spm

    chunks = _training_chunks(inputs, text_key)
    first = next(chunks, None)
    if first is None:
        fail(f"no text found under key {text_key!r} in {', '.join(map(str, inputs))}: check --text-key and the files")

    def sentences():
        yield first
        yield from chunks

    model = io.BytesIO()
    options = dict(
        sentence_iterator=sentences(), model_writer=model, model_type="unigram", vocab_size=vocab_size,
        byte_fallback=True, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, control_symbols=LLMJP_CONTROL_PIECES,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        split_digits=True, allow_whitespace_only_pieces=True, split_by_whitespace=False,
        max_sentencepiece_length=16, max_sentence_length=1 << 16, character_coverage=0.9995,
        input_sentence_size=max_sentences or 0, shuffle_input_sentence=True,
        seed_sentencepiece_size=seed_sentencepiece_size, num_threads=num_threads or max(1, os.cpu_count() or 1),
        hard_vocab_limit=True, minloglevel=2 if quiet else 0,
    )
    try:
        spm.SentencePieceTrainer.Train(**options)
    except RuntimeError as exc:
        msg = str(exc).strip().splitlines()[-1] if str(exc).strip() else repr(exc)
        if "Vocabulary size" in msg or "vocab_size" in msg:
            fail(f"SentencePiece cannot make {vocab_size} pieces from this text ({msg}): lower --vocab-size or "
                 f"give it more text")
        fail(f"SentencePiece training failed: {msg}")
    return model.getvalue()


def save_hf_tokenizer(sp_model: str | Path, output_dir: str | Path) -> None:
    """Write ``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json`` and ``tokenizer.model``.

    ``AutoTokenizer.from_pretrained(output_dir)`` then loads a ``PreTrainedTokenizerFast`` offline (no remote code)
    with ``tok(text)["input_ids"] == [bos] + sp.encode(text)`` (add_bos=True, add_eos=False, as LLM-jp's HF
    tokenizer). One known difference: text that literally spells a control piece (``</s>``) is read as that
    special token by HF but as plain characters by SentencePiece; the data pipeline uses SentencePiece.
    """
    sp_model = Path(sp_model)
    if not sp_model.is_file():
        fail(f"tokenizer {sp_model} not found: pass a SentencePiece .model file")
    backend, names = build_hf_backend(sp_model)
    output_dir = ensure_writable_dir(output_dir, "tokenizer")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": True,
        "add_eos_token": False,
        **names,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1000000000000000019884624838656,
        "model_input_names": ["input_ids", "attention_mask"],
        "padding_side": "right",
    }
    # the .model first, so that the directory also works with load_tokenizer; tokenizer.json last
    if sp_model.resolve() != (output_dir / MODEL_FILE).resolve():
        write_bytes_atomic(output_dir / MODEL_FILE, sp_model.read_bytes())
    write_bytes_atomic(output_dir / "special_tokens_map.json", json.dumps(names, indent=2, ensure_ascii=False).encode())
    write_bytes_atomic(output_dir / "tokenizer_config.json", json.dumps(config, indent=2, ensure_ascii=False).encode())
    write_bytes_atomic(output_dir / "tokenizer.json", backend.to_str(pretty=True).encode())


# -- CLI ----------------------------------------------------------------------------------------------------
MAX_VOCAB = 2**31 - 1  # SentencePiece stores the vocabulary size and ids as int32


def _check_numbers(args) -> None:
    """The numeric arguments, before any file is read or directory made (SentencePiece would end a bad one in a
    traceback after reading the whole input)."""
    min_vocab = 8 + 256 + 1  # the special and byte pieces, plus one learnt piece
    if not min_vocab <= args.vocab_size <= MAX_VOCAB:
        fail(f"--vocab-size {args.vocab_size} is out of range: the special and byte pieces alone take "
             f"{min_vocab - 1}, and SentencePiece counts in int32; pass {min_vocab} to {MAX_VOCAB} (LLM-jp v3: "
             f"99574)")
    if args.max_sentences is not None and not 1 <= args.max_sentences <= MAX_VOCAB:
        fail(f"--max-sentences {args.max_sentences} is out of range: pass a count of text chunks from 1 to "
             f"{MAX_VOCAB}, or leave it out to use every chunk")


def cli_main(argv: list[str], verb: str = "train-tokenizer") -> int:
    parser = argparse.ArgumentParser(
        prog=f"llmjp-ds {verb}",
        description="Train a SentencePiece unigram tokenizer (byte fallback, LLM-jp v3 special pieces) from jsonl, "
                    "parquet or Arrow datasets, and save it as a Hugging Face tokenizer directory. With --from-model, "
                    "only convert an existing .model (e.g. LLM-jp's) into that directory.")
    parser.add_argument("--input", nargs="+", default=[], metavar="PATH",
                        help="files, directories or globs (quoted), mixed: jsonl (plain or compressed), parquet, Arrow")
    parser.add_argument("--output-dir", required=True, help="directory for tokenizer.model + HF tokenizer files")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--text-key", default="text",
                        help="json key or column holding the document text (default: text)")
    parser.add_argument("--max-sentences", type=int, default=None,
                        help="sample at most this many text chunks (~2,000 characters each) for training")
    parser.add_argument("--from-model", default=None, metavar="MODEL",
                        help="skip training: convert this SentencePiece .model into --output-dir")
    parser.add_argument("--force", action="store_true", help="replace an existing tokenizer in --output-dir")
    args = parser.parse_args(argv)
    _check_numbers(args)
    if args.from_model:
        source = resolve_model_path(args.from_model)
        target = Path(args.output_dir)
        if (target / MODEL_FILE).exists() and not args.force:
            fail(f"{target / MODEL_FILE} already exists: choose another --output-dir, or pass --force to replace it")
        save_hf_tokenizer(source, target)
    else:
        if not args.input:
            fail("no --input given: pass files (jsonl, parquet, Arrow) to train on, or --from-model MODEL to "
                 "convert a model")
        train_tokenizer(args.input, args.output_dir, args.vocab_size, args.text_key, args.max_sentences,
                        force=args.force, quiet=True)
    tok = load_tokenizer(args.output_dir)
    print(f"wrote {Path(args.output_dir) / MODEL_FILE} and HF tokenizer files ({tok.vocab_size} pieces)",
          file=sys.stderr)
    return 0
