"""Corpora and tokenizers: the embedded sample corpus (sample.py) and SentencePiece training (tokenizer.py), with
their commands `albert data sample` and `albert tokenizer train` (cli.py)."""
