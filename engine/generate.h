/* generate.h: the `kvserve generate` subcommand (engine/generate.c): one prompt, no server.
 *
 * kvs_generate_main(argc, argv) takes the subcommand's own argv (argv[0] = "generate"), prints
 * the continuation on stdout (text, or ids with --print-ids / without a tokenizer) and timings
 * on stderr. Returns the process exit code: 0 ok, 1 runtime error, 2 bad usage (message on
 * stderr). Everything it allocates is freed before it returns.
 */
#ifndef KVS_GENERATE_H
#define KVS_GENERATE_H

int kvs_generate_main(int argc, char **argv);

#endif
