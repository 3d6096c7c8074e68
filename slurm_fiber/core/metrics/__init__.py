"""fiberd's metrics: the Prometheus families and where Prometheus reads them."""
