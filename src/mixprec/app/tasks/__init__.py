"""Built-in tasks: real data that ships with every machine, and the models trained on it."""
