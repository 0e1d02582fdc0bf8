"""From files to token ids: reading corpora (text folders, JSONL, Parquet, MediaWiki dumps; `corpus`, with the
records it yields in `records` and each format's reader in `readers`), cutting big files into regions on record
boundaries (`regions`), cleaning wikitext (`wikitext`), sentence splitting (`sentences`), the SentencePiece
tokenizer, its training and `load_tokenizer` (`tokenization`), the WordPiece tokenizer of BERT checkpoints
(`wordpiece`), and vocabulary checks (`vocabulary`)."""
