"""From files to token ids: reading corpora (text folders, JSONL, Parquet, MediaWiki dumps; `corpus`), cutting big
files into regions on record boundaries (`regions`), cleaning wikitext (`wikitext`), sentence splitting
(`sentences`), the SentencePiece tokenizer and its training (`tokenization`), and vocabulary checks (`vocabulary`)."""
