"""Generator of the bundled demo corpus (``python -m llmjp_ds.data.corpus_gen``); see ``__main__`` for sizes."""
