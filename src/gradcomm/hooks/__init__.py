"""Communication hooks: one module per hook family, with torch's names and contracts."""
