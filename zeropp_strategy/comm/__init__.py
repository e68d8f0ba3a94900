"""Layer: comm."""
