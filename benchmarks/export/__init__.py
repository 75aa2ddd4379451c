"""Which method's result each export format holds (exported, refused or lossy)."""
