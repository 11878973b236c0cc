"""Everything beside the million-token path: extensions and run infrastructure (README.md here is the guide)."""
