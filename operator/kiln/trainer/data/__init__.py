"""Data: token sources and the global-batch loader, chat rendering, and `kiln data prepare`."""
