"""The Lark grammar of the `.cell` language, shipped as package data (`cortexc.grammars`)."""
