"""From files to token ids: reading corpora (text folders, JSONL, Parquet, MediaWiki dumps; `corpus`, with the
records it yields in `records` and each format's reader in `readers`), cutting big files into regions on record
boundaries (`regions`), cleaning wikitext (`wikitext`), sentence splitting (`sentences`), the SentencePiece
tokenizer and its training (`tokenization`), and vocabulary checks (`vocabulary`)."""
