"""pipedejavu.core."""
