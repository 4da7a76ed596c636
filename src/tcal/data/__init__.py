"""Data: corpora, tokens and windows, token streams, token pools and their sources, teachers."""
