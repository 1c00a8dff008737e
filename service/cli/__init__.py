"""Layer 5, the command line: the only code that imports several roles."""
