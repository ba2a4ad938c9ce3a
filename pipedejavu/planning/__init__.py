"""pipedejavu.planning."""
