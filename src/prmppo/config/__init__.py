"""Config schemas (`schema.py`) and cross-field validation (`validate.py`)."""
