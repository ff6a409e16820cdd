package jobs

import "github.com/jackc/pgx/v5/pgxpool"

// Builtin returns the jobs defined in code. This is the one place to
// register one: write a type with Name() and Run(ctx) (or use Func) and add
// its Spec to the list, for example
//
//	Spec{
//		Job:   Func("refresh-report-cache", func(ctx context.Context) error { ... }),
//		Delay: time.Minute,
//	},
//
// Startup passes Builtin(pool) and FromDefinitions(...) to New; names must
// be unique across both. pool is there for jobs that use the database.
func Builtin(pool *pgxpool.Pool) []Spec {
	return []Spec{}
}
