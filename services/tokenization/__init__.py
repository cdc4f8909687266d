"""The model's tokenizer and chat template, shared by the gateway, the worker and the indexer."""
