"""Checkpoints: distributed saves and resumes, their checksummed commit record, the in-memory copies on the nodes
and their placement, and the page-cache window the files are written through."""
