"""pipedejavu.io."""
