"""Optional integrations with training frameworks; each module imports its framework lazily."""
