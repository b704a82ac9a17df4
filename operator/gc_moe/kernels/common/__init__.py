"""Device-side pieces every kernel shares: ring signals, bounded waits, PTX helpers."""
