"""The compiler's passes and stages (golden dumps of every stage among them)."""
