"""Who a sandbox is: gateway tokens (EdDSA JWTs), their signing keys and revocation."""
