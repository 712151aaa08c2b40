"""The agent's DNS proxy (dns.md): mesh names from the NDS name table, everything else forwarded upstream."""
