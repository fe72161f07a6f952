"""`hpkit data prepare`: text, JSONL and Parquet files -> token shards with an index, which training memory-maps.

`index` (the on-disk format) needs only the standard library, so that the training runtime reads it without the
`data` extra; the rest (`tokenizer`, `sources`, `shards`, `prepare`) needs `tokenizers`, `pyarrow` and numpy.
"""
