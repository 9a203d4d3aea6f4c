"""CSS and JavaScript the web pages load from the leader itself (no CDN)."""
