"""The front end: parsing, checking and lowering `.cell` text, and its located errors."""
