"""One generation under every API face: the pipeline (lease, render, admit, submit, stream, time out) and
what it uses: the answer split into thoughts, text and tool calls (answer.py, reasoning.py, tools.py) and
the grammars that constrain it (grammars.py)."""
