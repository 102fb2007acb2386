"""Pure-Python, torch-free schedulers (see interface.py for the contract with the stage loop)."""
