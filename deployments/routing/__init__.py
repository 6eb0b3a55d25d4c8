"""Request routing and admission: pure policies (plain data and `now_s` in, decisions out)
and the Ray Serve adapter that feeds them."""
