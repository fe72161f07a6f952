"""A run's metrics file: the records `hpkit train` writes (records) and how readers read the file (file)."""
