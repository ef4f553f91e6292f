"""The production-shaped stack on one machine (``make stack``): see stack/run.py."""
