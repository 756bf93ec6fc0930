/* PLACEHOLDER */
typedef int pkv_placeholder_llama;
