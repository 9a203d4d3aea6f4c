"""Bearer API tokens: minting, hashed storage, scopes, and the app-wide guard that enforces them."""
