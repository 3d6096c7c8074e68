"""Trust: who may issue grants, the tokens they sign, and the grant a verified token says."""
