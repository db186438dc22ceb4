"""How the chat writes a model's name where room is short (a pane's title, the panel's model lines)."""

from __future__ import annotations


def short_model_name(name: str, width: int = 28) -> str:
    """A path's last part (a name or tag as it is), cut to `width` with an ellipsis."""
    base = name.rstrip("/").rsplit("/", 1)[-1] if name.startswith(("/", "~", ".")) else name
    return base if len(base) <= width else base[: width - 1] + "…"
