"""The Structured Recurrent Mixer (docs/srm.md)."""
