"""Text in and out: prompts to token ids and chat templates (prompt.py), token ids to streamed text
with stop strings held back (detokenizer.py)."""
