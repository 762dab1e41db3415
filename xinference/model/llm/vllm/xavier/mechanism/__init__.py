"""mechanism"""
