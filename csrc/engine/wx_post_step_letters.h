/* wx_post_step_letters.h - one-letter names of the post stage's states (wx_post_step.h), for
 * the grids written with them: wx_post_step.c's table and tests/c/post_step_check.c's. Only
 * those two .c files include it (the letters are not for the engine's headers). */
#ifndef WX_POST_STEP_LETTERS_H
#define WX_POST_STEP_LETTERS_H

#include "wx_post_step.h"

#define Q WX_TP_QUEUED
#define P WX_TP_POSTING
#define F WX_TP_WAIT_FENCE
#define D WX_TP_WAIT_DEPTH
#define B WX_TP_BACKOFF
#define R WX_TP_RETIRED

#endif
