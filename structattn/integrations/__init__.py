"""structattn inside other libraries, each an optional extra: ``integrations.transformers``."""
