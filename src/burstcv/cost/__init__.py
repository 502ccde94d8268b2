"""Put a price on compute: the dated price table and EC2's billing rule (see ``pricing``)."""
