"""pipedejavu.simulation."""
