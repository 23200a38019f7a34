"""Decode stalls (being written)."""
import streamlit as st

st.title("Decode stalls")
