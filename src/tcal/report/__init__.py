"""Reports: plots (object-oriented matplotlib), tables and recovery targets."""
