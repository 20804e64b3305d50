"""Worker processes on this machine: the process transport and what it is made of."""
