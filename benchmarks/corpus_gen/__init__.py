"""Generator of the bundled demo corpus ``llmjp_ds/data/corpus/`` (``python -m benchmarks.corpus_gen`` from the
repository root); see ``__main__`` for sizes. Not part of the installed package."""
