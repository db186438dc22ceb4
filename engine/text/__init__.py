"""Text in and out: the tokenizer with its chat template, and the grammars of structured output."""
