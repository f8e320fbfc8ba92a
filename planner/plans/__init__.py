"""Plans: the versioned plan file format, its JSON schema and how decisions are read."""
