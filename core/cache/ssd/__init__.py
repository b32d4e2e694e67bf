"""The SSD tier: its file format (``format.py``), I/O (``io.py``) and the tier with its
writer and verifier threads (``tier.py``). docs/DESIGN.md §8.4."""
