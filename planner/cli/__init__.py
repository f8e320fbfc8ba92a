"""The memplan command line: one module per subcommand; rendering lives in report."""
