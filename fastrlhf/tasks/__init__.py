"""Built-in tasks: synthetic data, tokenizers and rule rewards for the embedded demo and the tests."""
